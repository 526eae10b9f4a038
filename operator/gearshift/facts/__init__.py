"""Facts and formulas every layer shares, pure: GPU datasheets (:mod:`.gpus`), a model's per-layer costs
(:mod:`.model`), the roofline step time (:mod:`.roofline`), fleet files (:mod:`.fleet`) and how vLLM reads
request values (:mod:`.lax`), and the two input errors every layer raises (:mod:`.errors`)."""
