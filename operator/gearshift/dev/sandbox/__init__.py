"""The sandbox cluster: a real Kubernetes control plane run as local processes, with fake GPU nodes.

Modules:
  - ``layout``: where the sandbox keeps its state, its name, its loopback octet, the binaries;
  - ``nodes``: fleet file → Node manifests (pure);
  - ``stages``: kwok Stage documents that leave opted-in pods to the pod runner (pure);
  - ``prometheus``: the Prometheus configuration (pure) and its process;
  - ``procs``: managed local processes with pid files;
  - ``cluster``: ``up``/``down``/``status`` orchestration;
  - ``podspec`` and ``podrunner``: the local pod runner (pure helpers, and the watch loop), with
    ``containers`` (one container as a local process), ``podstatus`` (the status it reports, pure),
    ``podinputs`` (ConfigMaps, Secrets and ServiceAccount tokens from the API) and ``runlog``;
  - (the tiny servers the runner's e2e tests run inside pods are :mod:`gearshift.testing.servers`);
  - ``cli``: ``gearshift sandbox ...``.
"""
