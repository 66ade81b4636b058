"""Integration with training loops: the DDP communication hook, the synchronizer for methods that
need the optimizer, and DGC's training techniques (:mod:`.dgc`)."""
