"""Serve an MLA checkpoint over HTTP: the same program as ``mla-runtime serve`` (mla_runtime/serving/server.py).

    python server.py                                  # the embedded demo model on 127.0.0.1:8000
    python server.py --model PATH --port 8080 --max-model-len 8192 --kv-cache-memory 8GiB
    python server.py --config serve.yaml --api-key "$KEY"   # flags override the file
    torchrun --nproc-per-node 2 server.py --tensor-parallel-size 2   # rank 0 serves HTTP

Endpoints: POST /generate, /v1/completions, /v1/chat/completions (SSE with "stream": true);
GET /v1/models, /health, /ready, /metrics. See ``python server.py --help`` for every flag and
``mla_runtime/serving/serve.example.yaml`` for the file layout.

SIGTERM or Ctrl-C stops accepting connections, lets in-flight requests finish for up to
``--shutdown-timeout`` seconds, aborts the rest, stops the engine and exits 0. A start-up failure
(bad configuration, weights that do not load, a failed probe generation) exits 1 with the reason.
"""

import sys

from mla_runtime.serving.config import build_parser

if __name__ == "__main__":
    build_parser().parse_args()  # --help and flag errors before the server (and torch) is imported
    from mla_runtime.serving.server import main

    sys.exit(main())
