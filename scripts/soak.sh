#!/usr/bin/env bash
# Minutes of mixed traffic against a Foresight server on 127.0.0.1; the logic and every flag are in
# scripts/soak.py (`scripts/soak.sh --help`). Without --url it starts `foresight serve` and stops it after.
#   scripts/soak.sh [--minutes N] [--url http://127.0.0.1:PORT] [--concurrency C] [--out F] [-- SERVE_FLAGS]
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${VENV:-.venv}/bin/python" scripts/soak.py "$@"
