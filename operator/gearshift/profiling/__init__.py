"""GPU profiling as pure steps: compute classes, node labels and overrides over a fleet
(:mod:`.profiles`), one GPUProfile's probe life cycle (:mod:`.lifecycle`). The kopf handler
(:mod:`gearshift.handlers.gpuprofile`) does the I/O."""
