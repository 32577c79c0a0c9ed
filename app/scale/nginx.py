"""The load balancer of the scale topology on one machine: the project's own nginx configuration
(``docker/nginx.conf``, the one the compose file mounts) with the voice servers' loopback addresses.

Why rendered from that file and not written again here: one configuration for both ways of scaling out, so
what the tests prove through this one (WebSocket upgrades, the Realtime door, least connections, a dead
server skipped) holds for the Docker one. Three lines differ: Docker's resolver goes (the addresses are
fixed), ``server voice:8000 resolve ...`` becomes one ``server`` per voice server with the same parameters
(``resolve`` needs nginx >= 1.27.3; Debian 12 ships 1.22), and ``listen 80`` becomes the chosen address.
nginx runs in the foreground under the supervisor, its pid, logs and temporary files in the run folder.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = ROOT / "docker" / "nginx.conf"
DOCKER_UPSTREAM = "voice:8000 resolve"
DOCKER_LISTEN = "listen 80;"
TEMP_DIRS = ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")


class NginxError(RuntimeError):
    """nginx is missing or the configuration cannot be made."""


def nginx_binary() -> str:
    """The nginx program (Debian installs it in /usr/sbin, not on a user's PATH)."""
    found = shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin:/usr/local/sbin:/usr/local/nginx/sbin")
    if found is None:
        raise NginxError(
            "nginx is not installed: `sudo apt-get install nginx` (Debian/Ubuntu) or your system's package"
        )
    return found


def render(template: str, *, listen: str, upstreams: list[str], run_dir: Path) -> str:
    """A whole nginx.conf: the template's ``http`` contents with ``upstreams`` (host:port each) behind ``listen``."""
    if template.count(DOCKER_UPSTREAM) != 1 or template.count(DOCKER_LISTEN) != 1:
        raise NginxError(f"{TEMPLATE}: expected one `server {DOCKER_UPSTREAM} ...` line and one `{DOCKER_LISTEN}`")
    if not upstreams:
        raise NginxError("no voice server to balance")
    lines = []
    for line in template.splitlines():
        stripped = line.strip()
        if stripped.startswith("resolver "):  # Docker's DNS: the addresses here are fixed
            continue
        if DOCKER_UPSTREAM in line:
            lines += [line.replace(DOCKER_UPSTREAM, address) for address in upstreams]
            continue
        lines.append(line.replace(DOCKER_LISTEN, f"listen {listen};"))
    body = "\n".join("    " + line if line else "" for line in lines)
    temp = "\n".join(f"    {name}_temp_path {run_dir / 'tmp' / name};" for name in TEMP_DIRS)
    return f"""# made by `parley scale up` from {TEMPLATE}: do not edit (it is written again at each start)
worker_processes 1;
daemon off;
pid {run_dir / "nginx.pid"};
error_log {run_dir / "nginx-error.log"} warn;

events {{
    worker_connections 1024;
}}

http {{
    access_log {run_dir / "nginx-access.log"};
{temp}

{body}
}}
"""


def write_conf(run_dir: Path, *, listen: str, upstreams: list[str]) -> Path:
    """Write ``run_dir/nginx.conf`` and the temporary folders its workers write to; returns the file."""
    if not TEMPLATE.is_file():
        raise NginxError(f"{TEMPLATE} is missing: `parley scale` runs from a checkout of the project")
    for name in TEMP_DIRS:
        folder = run_dir / "tmp" / name
        folder.mkdir(parents=True, exist_ok=True)
        if os.geteuid() == 0:  # workers run as nobody when the master is root
            folder.chmod(0o777)
    conf = run_dir / "nginx.conf"
    conf.write_text(render(TEMPLATE.read_text(), listen=listen, upstreams=upstreams, run_dir=run_dir))
    return conf


def command(program: str, conf: Path, run_dir: Path) -> list[str]:
    """nginx (``program``) on ``conf`` (``-e`` keeps its start-up errors out of the system's log folder)."""
    return [program, "-p", str(run_dir), "-c", str(conf), "-e", str(run_dir / "nginx-error.log")]
