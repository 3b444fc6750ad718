#!/bin/bash
# Build the cel-go referee: assemble a vendor/ tree from bare git mirrors (as the search tool's
# `fetch` leaves them under /work/.mirror), pinned to the versions k8s.io/apiserver v0.36.3
# (Kubernetes 1.36) requires, then `go build -mod=vendor` with no network.
#   benchmarks/cel_conformance/referee/build.sh OUT_BINARY [MIRROR_DIR] [GO]
set -euo pipefail
out=$(realpath -m "$1") mirror=${2:-/work/.mirror} go=${3:-go}
here=$(dirname "$(realpath "$0")")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# module  version  mirror  git-ref  subdir-in-repo
modules="
github.com/google/cel-go v0.26.0 google+cel-go v0.26.0 .
cel.dev/expr v0.25.1 google+cel-spec v0.25.1 .
github.com/antlr4-go/antlr/v4 v4.13.0 antlr4-go+antlr v4.13.0 .
golang.org/x/text v0.33.0 golang+text v0.33.0 .
golang.org/x/exp v0.0.0-20251219203646-944ab1f22d93 golang+exp 944ab1f22d93 .
golang.org/x/sync v0.19.0 golang+sync v0.19.0 .
golang.org/x/net v0.49.0 golang+net v0.49.0 .
golang.org/x/sys v0.40.0 golang+sys v0.40.0 .
google.golang.org/protobuf v1.36.12-0.20260120151049-f2248ac996af protocolbuffers+protobuf-go f2248ac996af .
google.golang.org/genproto/googleapis/api v0.0.0-20260128011058-8636f8732409 googleapis+go-genproto 8636f8732409 googleapis/api
google.golang.org/genproto/googleapis/rpc v0.0.0-20260128011058-8636f8732409 googleapis+go-genproto 8636f8732409 googleapis/rpc
k8s.io/apiserver v0.36.3 kubernetes+apiserver v0.36.3 .
k8s.io/apimachinery v0.36.3 kubernetes+apimachinery v0.36.3 .
k8s.io/component-base v0.36.3 kubernetes+component-base v0.36.3 .
k8s.io/klog/v2 v2.140.0 kubernetes+klog v2.140.0 .
k8s.io/utils v0.0.0-20260210185600-b8788abfbbc2 kubernetes+utils b8788abfbbc2 .
k8s.io/kube-openapi v0.0.0-20260317180543-43fb72c5454a kubernetes+kube-openapi 43fb72c5454a .
github.com/blang/semver/v4 v4.0.0 blang+semver v4.0.0 v4
github.com/go-logr/logr v1.4.3 go-logr+logr v1.4.3 .
gopkg.in/inf.v0 v0.9.1 go-inf+inf v0.9.1 .
sigs.k8s.io/json v0.0.0-20250730193827-2d320260d730 kubernetes-sigs+json cfa47c3 .
sigs.k8s.io/structured-merge-diff/v6 v6.3.3 kubernetes-sigs+structured-merge-diff v6.3.3 .
sigs.k8s.io/yaml v1.6.0 kubernetes-sigs+yaml v1.6.0 .
sigs.k8s.io/randfill v1.0.0 kubernetes-sigs+randfill v1.0.0 .
github.com/gogo/protobuf v1.3.2 gogo+protobuf v1.3.2 .
github.com/json-iterator/go v1.1.12 json-iterator+go v1.1.12 .
github.com/modern-go/reflect2 v1.0.3-0.20250322232337-35a7c28c31ee modern-go+reflect2 35a7c28c31ee .
github.com/modern-go/concurrent v0.0.0-20180306012644-bacd9c7ef1dd modern-go+concurrent bacd9c7ef1dd .
github.com/fxamacker/cbor/v2 v2.9.0 fxamacker+cbor v2.9.0 .
github.com/x448/float16 v0.8.4 x448+float16 v0.8.4 .
github.com/spf13/pflag v1.0.9 spf13+pflag v1.0.9 .
github.com/davecgh/go-spew v1.1.2-0.20180830191138-d8f796af33cc davecgh+go-spew d8f796af33cc .
github.com/google/go-cmp v0.7.0 google+go-cmp v0.7.0 .
github.com/prometheus/client_golang v1.23.2 prometheus+client_golang v1.23.2 .
github.com/prometheus/client_model v0.6.2 prometheus+client_model v0.6.2 .
github.com/prometheus/common v0.67.5 prometheus+common v0.67.5 .
github.com/prometheus/procfs v0.19.2 prometheus+procfs v0.19.2 .
github.com/google/gnostic-models v0.7.0 google+gnostic-models v0.7.0 .
github.com/stoewer/go-strcase v1.3.0 stoewer+go-strcase v1.3.0 .
go.yaml.in/yaml/v2 v2.4.3 yaml+go-yaml v2.4.3 .
k8s.io/api v0.36.3 kubernetes+api v0.36.3 .
github.com/beorn7/perks v1.0.1 beorn7+perks v1.0.1 .
github.com/cespare/xxhash/v2 v2.3.0 cespare+xxhash v2.3.0 .
github.com/munnerz/goautoneg v0.0.0-20191010083416-a7dc8b61c822 munnerz+goautoneg a7dc8b61c822 .
go.opentelemetry.io/otel v1.41.0 open-telemetry+opentelemetry-go v1.41.0 .
go.opentelemetry.io/otel/trace v1.41.0 open-telemetry+opentelemetry-go trace/v1.41.0 trace
go.opentelemetry.io/otel/metric v1.41.0 open-telemetry+opentelemetry-go metric/v1.41.0 metric
github.com/spf13/cobra v1.10.2 spf13+cobra v1.10.2 .
${EXTRA_MODULES:-}
"
# Copy the tree at REF:SUB into DEST, skipping blobs the mirror left out (its largest files:
# none of them is in a package the referee builds).
extract() {
  python3 - "$@" <<'PY'
import os, subprocess, sys
gitdir, ref, sub, dest = sys.argv[1:]
prefix = "" if sub == "." else sub.rstrip("/") + "/"
tree = subprocess.run(["git", f"--git-dir={gitdir}", "ls-tree", "-r", "-z", f"{ref}:{'' if sub == '.' else sub}"],
                      capture_output=True, check=True).stdout.split(b"\0")
blobs = []
for entry in tree:
    if not entry:
        continue
    meta, path = entry.split(b"\t", 1)
    mode, kind, sha = meta.split()
    if kind == b"blob" and mode != b"120000":
        blobs.append((sha.decode(), path.decode()))
cat = subprocess.Popen(["git", f"--git-dir={gitdir}", "cat-file", "--batch"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
for sha, path in blobs:
    cat.stdin.write(sha.encode() + b"\n"); cat.stdin.flush()
    header = cat.stdout.readline().split()
    if header[-1] == b"missing":
        continue
    data = cat.stdout.read(int(header[2])); cat.stdout.read(1)
    target = os.path.join(dest, path)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    with open(target, "wb") as f:
        f.write(data)
cat.stdin.close(); cat.wait()
PY
}
mkdir -p "$work/vendor"
{
  echo "module dra-agent/celreferee"
  echo "go 1.26.0"
  echo "require ("
} >"$work/go.mod"
: >"$work/vendor/modules.txt"
while read -r path version repo ref sub; do
  [[ -n "$path" ]] || continue
  dest="$work/vendor/$path"
  mkdir -p "$dest"
  extract "$mirror/$repo/repo" "$ref" "$sub" "$dest"
  # Nested modules are not part of this one.
  find "$dest" -mindepth 2 -name go.mod -printf '%h\n' | xargs -r rm -rf
  gover=$( (sed -n "s/^go \([0-9.]*\).*/\1/p" "$dest/go.mod" 2>/dev/null || true) | head -1)
  echo "  $path $version" >>"$work/go.mod"
  {
    echo "# $path $version"
    echo "## explicit${gover:+; go $gover}"
    (cd "$dest" && find . -name '*.go' ! -name '*_test.go' ! -path '*/testdata/*' -printf '%h\n' | sort -u |
      sed "s#^\.#$path#; s#/\$##")
  } >>"$work/vendor/modules.txt"
done <<<"$modules"
echo ")" >>"$work/go.mod"
cp "$here"/*.go "$work/"
cd "$work"
GOPROXY=off GOTOOLCHAIN=local GOFLAGS=-mod=vendor GOWORK=off CGO_ENABLED=0 "$go" build -o "$out" .
