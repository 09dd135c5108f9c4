"""A stand-in engine server for launch tests: GET /health answers 200 with the GPUs it was given.

argv: --port PORT [EXIT_AFTER_S EXIT_STATUS]: with the last two, it exits with EXIT_STATUS after EXIT_AFTER_S seconds
(a crashing server).
"""

import json
import os
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Health(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = json.dumps({"gpus": os.environ.get("CUDA_VISIBLE_DEVICES"), "pid": os.getpid()}).encode()
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


server = ThreadingHTTPServer(("127.0.0.1", int(sys.argv[2])), Health)
if len(sys.argv) > 4:
    threading.Timer(float(sys.argv[3]), lambda: os._exit(int(sys.argv[4]))).start()
server.serve_forever()
