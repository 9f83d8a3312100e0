"""What the object-storage benchmarks share: a local S3-compatible server (moto, in its own
process on 127.0.0.1, so it does not share the benchmark's GIL) and one variant per fresh
process."""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from typing import Iterator, Optional

SERVER = ("from moto.server import ThreadedMotoServer; import time; "
          "s = ThreadedMotoServer(ip_address='127.0.0.1', port=0, verbose=False); s.start(); "
          "print(s.get_host_and_port()[1], flush=True); time.sleep(10**7)")


@contextlib.contextmanager
def s3_server(bucket: str = "bench") -> Iterator[dict]:
    """The server's storage_options (a made-up key), with ``bucket`` made; killed on exit."""
    os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
    import fsspec
    server = subprocess.Popen([sys.executable, "-c", SERVER], stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True)  # not its request log
    try:
        opts = {"endpoint_url": f"http://127.0.0.1:{int(server.stdout.readline())}",
                "key": "bench", "secret": "bench", "client_kwargs": {"region_name": "us-west-2"}}
        fsspec.filesystem("s3", **opts).mkdir(bucket)
        yield opts
    finally:
        server.kill()
        server.wait()


def run_variant(script: str, spec: dict) -> dict:
    """``script --variant SPEC`` in a fresh interpreter: the JSON object it prints last."""
    out = subprocess.run([sys.executable, script, "--variant", json.dumps(spec)],
                         capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"variant {spec['name']} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def print_medians(rows: dict, unit: str, base: Optional[str] = None) -> dict:
    """One line per variant (median, range, and the ratio of medians to ``base``); the medians."""
    med = {k: sorted(v)[len(v) // 2] for k, v in rows.items()}
    for k, v in rows.items():
        ratio = f"  ratio to {base} {med[k] / med[base]:.2f}" if base and med.get(base) else ""
        print(f"  {k:15s} median {med[k]:8.1f} {unit}  (range {min(v):.1f}-{max(v):.1f}){ratio}")
    return med
