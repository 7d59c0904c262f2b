#!/usr/bin/env bash
# Generate the Python stubs of proto/worker.proto, reproducibly.
#
#   proto/generate.sh            # writes proto/worker_pb2.py, worker_pb2_grpc.py, worker_pb2.pyi
#   proto/generate.sh OUT_DIR    # writes them into OUT_DIR instead (tests compare the two)
#
# Uses grpc_tools.protoc (the protoc bundled with grpcio-tools, a dev dependency) from $PYTHON
# (default: python3). The stubs are checked in; rerun this after editing worker.proto.
set -euo pipefail

PROTO_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OUT_DIR="${1:-$PROTO_DIR}"
PYTHON="${PYTHON:-python3}"
mkdir -p "$OUT_DIR"

"$PYTHON" -m grpc_tools.protoc \
  --proto_path="$PROTO_DIR" \
  --python_out="$OUT_DIR" \
  --pyi_out="$OUT_DIR" \
  --grpc_python_out="$OUT_DIR" \
  "$PROTO_DIR/worker.proto"

# protoc writes a top-level `import worker_pb2`; the stubs live in the package fuseserve.proto.
sed -i 's/^import worker_pb2 as worker__pb2$/from fuseserve.proto import worker_pb2 as worker__pb2/' \
  "$OUT_DIR/worker_pb2_grpc.py"
grep -q '^from fuseserve.proto import worker_pb2 as worker__pb2$' "$OUT_DIR/worker_pb2_grpc.py"
