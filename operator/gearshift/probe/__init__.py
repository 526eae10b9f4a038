"""The GPU probe (``gearshift-probe``): measures a node's GPUs and the links between nodes.

Modules: ``timing`` (repetitions, median and spread), ``backends`` (PyTorch CUDA/CPU, NumPy),
``ops`` (the measured operators), ``run`` (a node's device probe), ``simulated`` (the sandbox's
datasheet device), ``link`` (pairwise TCP link probe and pair selection), ``report`` (the versioned
JSON schema, validation, and the mapping onto ``GPUProfile.status``).
"""
