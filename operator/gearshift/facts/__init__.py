"""Facts and formulas every layer shares, pure: GPU datasheets (:mod:`.gpus`), a model's per-layer costs
(:mod:`.model`), the roofline step time (:mod:`.roofline`), fleet files (:mod:`.fleet`), how vLLM reads
request values (:mod:`.lax`), RFC 3339 times (:mod:`.rfc3339`) and the two input errors every layer
raises (:mod:`.errors`)."""
