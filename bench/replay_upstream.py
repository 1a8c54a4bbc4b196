"""The fake upstream answering as harness.replay's model, in its own process (so the
benchmark's load generator and the fake do not share one interpreter).

    python -m bench.replay_upstream --port 0    # prints "READY http://127.0.0.1:PORT"
"""

from __future__ import annotations

import argparse

import uvicorn

from harness.replay import Model
from proxy.demo.fake.upstream import FakeUpstream
from proxy.demo.servers import bind_socket, format_url


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, default=0)
    args = ap.parse_args()
    fake = FakeUpstream(responder=Model(), record=False)
    sock = bind_socket("127.0.0.1", args.port)
    config = uvicorn.Config(fake, log_level="warning", access_log=False, lifespan="on")
    print(f"READY {format_url('127.0.0.1', sock.getsockname()[1])}", flush=True)
    uvicorn.Server(config).run(sockets=[sock])


if __name__ == "__main__":
    main()
