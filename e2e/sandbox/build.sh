#!/usr/bin/env bash
# Build the sandbox cluster's binaries from source through the Go module proxy, once.
#
# Each part is cached outside the repository under $GEARSHIFT_CACHE/bin/<part>-<version>/ and is
# rebuilt only when that directory lacks it, so a warm cache makes this a no-op. Kubernetes and etcd
# publish modules whose go.mod files carry `replace` directives (so `go install x@v` refuses them):
# we build them from a generated wrapper module that requires the release and pins every staging
# module `k8s.io/*` to its published v0.x version.
#
# Usage: e2e/sandbox/build.sh            # build what is missing, print the bin directory
#        e2e/sandbox/build.sh --print    # only print where the binaries are (no build)
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=versions.env
source "$here/versions.env"
cache=${GEARSHIFT_CACHE:-$HOME/.cache/gearshift}
export GOFLAGS=${GOFLAGS:--buildvcs=false}
export CGO_ENABLED=0

kube_dir=$cache/bin/kubernetes-$KUBE_VERSION
etcd_dir=$cache/bin/etcd-$ETCD_VERSION
kwok_dir=$cache/bin/kwok-$KWOK_VERSION
helm_dir=$cache/bin/helm-$HELM_VERSION

if [[ ${1:-} == --print ]]; then
  echo "$kube_dir:$etcd_dir:$kwok_dir:$helm_dir"
  exit 0
fi

start=$(date +%s)
say() { printf '[sandbox-build %4ds] %s\n' $(($(date +%s) - start)) "$*" >&2; }

# Go prints nothing for minutes while it compiles; a heartbeat shows the build is alive.
with_heartbeat() {
  local what=$1; shift
  "$@" &
  local pid=$!
  while kill -0 "$pid" 2>/dev/null; do
    sleep 30
    kill -0 "$pid" 2>/dev/null && say "  ... still building $what"
  done
  wait "$pid"
}

build_kubernetes() {
  local bins=(kube-apiserver kube-controller-manager kube-scheduler kubectl)
  local missing=0 b
  for b in "${bins[@]}"; do [[ -x $kube_dir/$b ]] || missing=1; done
  ((missing)) || { say "kubernetes $KUBE_VERSION: cached"; return; }
  say "kubernetes $KUBE_VERSION: building ${bins[*]} (10-25 min on 2 cores)"
  local src=$cache/src/kubernetes-$KUBE_VERSION
  mkdir -p "$src"
  local minor patch staging
  minor=$(cut -d. -f2 <<<"$KUBE_VERSION")
  patch=$(cut -d. -f3 <<<"$KUBE_VERSION")
  staging=v0.$minor.$patch
  (
    cd "$src"
    [[ -f go.mod ]] || go mod init gearshift.local/sandbox-kubernetes >/dev/null 2>&1
    go mod edit -require="k8s.io/kubernetes@$KUBE_VERSION"
    # Pin every staging module the release replaces with ./staging/src/k8s.io/X.
    local modfile
    modfile=$(go mod download -json "k8s.io/kubernetes@$KUBE_VERSION" | sed -n 's/.*"GoMod": "\(.*\)",/\1/p')
    grep -oE '^\s*k8s\.io/[a-z0-9-]+ => \./staging' "$modfile" | awk '{print $1}' | while read -r m; do
      go mod edit -replace="$m=$m@$staging"
    done
    cat >tools.go <<'EOF'
//go:build tools

package tools

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
	_ "k8s.io/kubernetes/cmd/kubectl"
)
EOF
    say "kubernetes: resolving modules"
    GOFLAGS="$GOFLAGS -tags=tools" go mod tidy >/dev/null
    local pkg=k8s.io/component-base/version
    local cgo=k8s.io/client-go/pkg/version
    local ld="-s -w"
    for p in $pkg $cgo; do
      ld+=" -X $p.gitVersion=$KUBE_VERSION -X $p.gitMajor=1 -X $p.gitMinor=$minor"
      ld+=" -X $p.gitTreeState=clean -X $p.buildDate=1970-01-01T00:00:00Z"
    done
    mkdir -p "$kube_dir.tmp"
    with_heartbeat kubernetes go build -ldflags "$ld" -o "$kube_dir.tmp/" \
      k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager \
      k8s.io/kubernetes/cmd/kube-scheduler k8s.io/kubernetes/cmd/kubectl
  )
  rm -rf "$kube_dir" && mv "$kube_dir.tmp" "$kube_dir"
  say "kubernetes $KUBE_VERSION: done"
}

build_etcd() {
  [[ -x $etcd_dir/etcd ]] && { say "etcd $ETCD_VERSION: cached"; return; }
  say "etcd $ETCD_VERSION: building"
  local src=$cache/src/etcd-$ETCD_VERSION
  mkdir -p "$src"
  (
    cd "$src"
    [[ -f go.mod ]] || go mod init gearshift.local/sandbox-etcd >/dev/null 2>&1
    go mod edit -require="go.etcd.io/etcd/server/v3@$ETCD_VERSION"
    for m in api/v3 client/pkg/v3 client/v3 pkg/v3; do
      go mod edit -require="go.etcd.io/etcd/$m@$ETCD_VERSION"
    done
    cat >tools.go <<'EOF'
//go:build tools

package tools

import _ "go.etcd.io/etcd/server/v3"
EOF
    GOFLAGS="$GOFLAGS -tags=tools" go mod tidy >/dev/null
    mkdir -p "$etcd_dir.tmp"
    with_heartbeat etcd go build -ldflags "-s -w" -o "$etcd_dir.tmp/etcd" go.etcd.io/etcd/server/v3
  )
  rm -rf "$etcd_dir" && mv "$etcd_dir.tmp" "$etcd_dir"
  say "etcd $ETCD_VERSION: done"
}

build_go_install() { # name dir version ldflags pkg...
  local name=$1 dir=$2 version=$3 ldflags=$4; shift 4
  local missing=0 p
  for p in "$@"; do [[ -x $dir/$(basename "${p%@*}") ]] || missing=1; done
  # A binary without the version stamp (built before this script stamped it) is rebuilt.
  [[ $name == helm && -x $dir/helm ]] && [[ $("$dir/helm" version --short 2>/dev/null) != "$version"* ]] && missing=1
  ((missing)) || { say "$name $version: cached"; return; }
  say "$name $version: building"
  rm -rf "$dir.tmp" && mkdir -p "$dir.tmp"
  for p in "$@"; do
    GOBIN="$dir.tmp" with_heartbeat "$name" go install -ldflags "-s -w $ldflags" "$p@$version"
  done
  # Keep files that are not binaries (kwok's stages) across a rebuild.
  [[ -d $dir/stages ]] && cp -r "$dir/stages" "$dir.tmp/"
  rm -rf "$dir" && mv "$dir.tmp" "$dir"
  say "$name $version: done"
}

# kwok's default Stage documents: `gearshift sandbox up` hands them to kwokctl with its own changes
# (operator/gearshift/dev/sandbox/stages.py), so they must match the kwok that was built.
copy_kwok_stages() {
  local dest=$kwok_dir/stages
  [[ -f $dest/pod-ready.yaml ]] && { say "kwok $KWOK_VERSION stages: cached"; return; }
  local dir k=kustomize/stage
  dir=$(cd "$cache" && go mod download -json "sigs.k8s.io/kwok@$KWOK_VERSION" | sed -n 's/.*"Dir": "\(.*\)",/\1/p')
  rm -rf "$dest.tmp" && mkdir -p "$dest.tmp"
  cp "$dir/$k/node/fast/node-initialize.yaml" "$dir/$k/node/heartbeat-with-lease/node-heartbeat-with-lease.yaml" \
    "$dir/$k/pod/fast/pod-ready.yaml" "$dir/$k/pod/fast/pod-complete.yaml" "$dir/$k/pod/fast/pod-delete.yaml" \
    "$dest.tmp/"
  chmod -R u+w "$dest.tmp"
  rm -rf "$dest" && mv "$dest.tmp" "$dest"
  say "kwok $KWOK_VERSION: default stages copied"
}

build_kubernetes
build_etcd
build_go_install kwok "$kwok_dir" "$KWOK_VERSION" "" sigs.k8s.io/kwok/cmd/kwok sigs.k8s.io/kwok/cmd/kwokctl
copy_kwok_stages
# `go install` leaves helm's version at the source default ("v3.22"); stamp it as helm's Makefile does.
hv=helm.sh/helm/v3/internal/version
build_go_install helm "$helm_dir" "$HELM_VERSION" "-X $hv.version=$HELM_VERSION -X $hv.gitTreeState=clean" \
  helm.sh/helm/v3/cmd/helm
say "all binaries ready"
echo "$kube_dir:$etcd_dir:$kwok_dir:$helm_dir"
