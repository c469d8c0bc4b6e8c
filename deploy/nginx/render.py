"""Render nginx.conf.template: `python deploy/nginx/render.py OUT --upstream HOST:PORT ...`.

The compose file's config is rendered with:
  python deploy/nginx/render.py deploy/nginx/nginx.compose.conf --listen 8080 \
      --upstream specserve-1:8000 --upstream specserve-2:8000 --runtime-dir /tmp \
      --access-log /dev/stdout --error-log /dev/stderr

docker-compose and the tests render the same template, so what is tested is what is deployed.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from string import Template

TEMPLATE = Path(__file__).with_name("nginx.conf.template")


def render(upstreams: list[str], listen: str = "8080", runtime_dir: str = "/tmp/nginx",
           access_log: str | None = None, error_log: str | None = None,
           max_fails: int = 1, fail_timeout_s: int = 10) -> str:
    servers = "\n".join(
        [f"        server {u} max_fails={max_fails} fail_timeout={fail_timeout_s}s;"
         for u in upstreams]
        + [f"        server {u} backup max_fails={max_fails} fail_timeout={fail_timeout_s}s;"
           for u in upstreams])
    return Template(TEMPLATE.read_text()).safe_substitute(
        UPSTREAM_SERVERS=servers, LISTEN=listen, PID_FILE=f"{runtime_dir}/nginx.pid",
        ERROR_LOG=error_log or f"{runtime_dir}/error.log",
        ACCESS_LOG=access_log or f"{runtime_dir}/access.log",
        TEMP_DIR=runtime_dir)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--listen", default="8080")
    parser.add_argument("--upstream", action="append", required=True)
    parser.add_argument("--runtime-dir", default="/tmp/nginx")
    parser.add_argument("--access-log")
    parser.add_argument("--error-log")
    args = parser.parse_args()
    Path(args.out).write_text(render(args.upstream, args.listen, args.runtime_dir,
                                     args.access_log, args.error_log))


if __name__ == "__main__":
    main()
