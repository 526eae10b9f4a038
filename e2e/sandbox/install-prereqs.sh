#!/usr/bin/env bash
# Install the sandbox's system prerequisites when they are missing: Debian's prometheus (the sandbox runs
# its own Prometheus process; the package's service is kept from starting via policy-rc.d exit 101).
set -euo pipefail
if command -v prometheus >/dev/null 2>&1; then
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1 || [[ $(id -u) -ne 0 ]]; then
  echo "prometheus is missing: install Debian's 'prometheus' package (apt-get install prometheus)" >&2
  exit 1
fi
echo "installing Debian's prometheus package (once)" >&2
export DEBIAN_FRONTEND=noninteractive
had_policy=0
[[ -e /usr/sbin/policy-rc.d ]] && had_policy=1
if ((!had_policy)); then
  printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
  chmod +x /usr/sbin/policy-rc.d
fi
apt-get update -qq
apt-get install -y -qq --no-install-recommends prometheus >/dev/null
((had_policy)) || rm -f /usr/sbin/policy-rc.d
