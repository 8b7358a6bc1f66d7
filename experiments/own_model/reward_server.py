"""The recipe's reward as a service: ``POST /score`` with ``{"prompts", "responses", "records"}`` answers
``{"scores": [...]}``, the protocol of realloc's ``remote_reward`` (standard library only, loopback only).

    python experiments/own_model/reward_server.py --port 8123
"""

from __future__ import annotations

import argparse
import http.server
import json

from my_reward import score

MAX_BODY = 64 << 20  # a request larger than this is refused (413), not read


class Handler(http.server.BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        size = int(self.headers.get("Content-Length") or 0)
        if size > MAX_BODY:
            self.send_error(413, "request too large")
            return
        try:
            body = json.loads(self.rfile.read(size))
            scores = score(body["prompts"], body["responses"], body["records"])
        except (ValueError, KeyError, TypeError) as e:  # a malformed request: the client's error, said as such
            self.send_error(400, f"{type(e).__name__}: {e}")
            return
        out = json.dumps({"scores": scores}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args: object) -> None:  # one line per request would drown the run's console
        pass


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, default=8123)
    args = p.parse_args()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    print(f"scoring on http://127.0.0.1:{args.port}/score", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
