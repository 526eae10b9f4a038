"""Facts and formulas every layer shares, pure: GPU datasheets (:mod:`.gpus`), a model's per-layer costs
(:mod:`.model`), the roofline step time (:mod:`.roofline`) and fleet files (:mod:`.fleet`)."""
