"""Write Prometheus scrape jobs for every load balancer of a fleetserve home (docs/metrics.md).

Each service's load balancer serves /metrics on its admin port (127.0.0.1) behind its own
bearer secret, and Prometheus takes one credential per job: so one job per service, its secret
in a 0600 file of its own. Reads $FLEETSERVE_HOME/lb/*.json (the LBs' config files; run it as
the home's owner) and writes OUT/lb-scrape-configs.yml and OUT/<service>.secret. Point
`scrape_config_files` at the YAML; run again (and reload Prometheus) after `up`, `down` or a
load balancer's restart (it gets a new admin port).

    python examples/prometheus/lb_scrape_configs.py --out /etc/prometheus/fleetserve
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path


def home() -> Path:
    return Path(os.environ.get("FLEETSERVE_HOME") or Path.home() / ".fleetserve").expanduser()


def write_private(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    tmp.replace(path)


def scrape_configs(lb_dir: Path, out: Path) -> str:
    """The YAML of one job per load balancer (JSON is YAML: no YAML library needed)."""
    jobs = []
    for config in sorted(lb_dir.glob("*.json")):
        c = json.loads(config.read_text())
        if not c.get("admin_secret"):
            continue
        secret = out / f"{c['service']}.secret"
        write_private(secret, c["admin_secret"])
        jobs.append(
            {
                "job_name": f"fleetserve-lb-{c['service']}",
                "metrics_path": "/metrics",
                "authorization": {"type": "Bearer", "credentials_file": str(secret.resolve())},
                "static_configs": [{"targets": [f"127.0.0.1:{c['admin_port']}"]}],
            }
        )
    return json.dumps({"scrape_configs": jobs}, indent=2) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--home", type=Path, default=None, help="default: $FLEETSERVE_HOME")
    parser.add_argument("--out", type=Path, required=True, help="folder for the YAML and secrets")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True, mode=0o700)
    text = scrape_configs((args.home or home()) / "lb", args.out)
    write_private(args.out / "lb-scrape-configs.yml", text)
    print(args.out / "lb-scrape-configs.yml")


if __name__ == "__main__":
    main()
