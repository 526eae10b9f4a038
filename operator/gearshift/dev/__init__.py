"""Developer tools, not shipped to a cluster: the sandbox control plane (:mod:`.sandbox`), the demo
(:mod:`.demo`) and the trace load generator (:mod:`.loadgen`)."""
