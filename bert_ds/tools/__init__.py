"""Commands around the system, not part of what a user's code imports: the throughput bench
(:mod:`.bench`), the offline wheel bundle (:mod:`.bundle`), metric plots (:mod:`.plot`), the
main job's fill-mask demo (:mod:`.demo`), the anchor projection (:mod:`.projection`) and the
configuration reference of docs/ (:mod:`.config_reference`)."""
