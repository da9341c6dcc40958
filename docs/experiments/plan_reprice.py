"""Price a recorded ``bunsan plan`` JSON (profile, network, predictions) again with the model at this checkout.

A plan recorded on a machine lent for a session (a GPU's, ``docs/experiments/gpu-h200/plan_*.json``)
cannot be measured again here, but its profile can be priced again: each row's recorded step against
:func:`bunsan.algorithms.cost_model.predict` now, so a change to the model shows in the rows it moves::

    python docs/experiments/plan_reprice.py docs/experiments/gpu-h200/plan_resnet20_b128.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from bunsan.algorithms import async_model as am
from bunsan.algorithms.network_model import Network


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: plan_reprice.py PLAN_JSON", file=sys.stderr)
        return 2
    sys.path.insert(0, str(Path(__file__).parent))
    from predict_reprice import profile_of

    try:
        record = json.loads(Path(argv[0]).read_text())
        profile, network, rows = profile_of(record["profile"]), Network(**record["network"]), record["predictions"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        print(f"plan_reprice: {argv[0]} is not a bunsan plan record ({err})", file=sys.stderr)
        return 2
    candidates = {c.label: c for c in am.default_candidates(1024)}
    print("workers  algorithm             recorded (ms)  now (ms)  efficiency now")
    for row in rows:
        if row["label"] not in candidates:
            print(f"plan_reprice: {row['label']!r} is not a default candidate of this checkout", file=sys.stderr)
            return 2
        n, candidate = row["workers"], candidates[row["label"]]
        now = am.predict(profile.at_workers(n), network, candidate, n).step_s
        print(
            f"{n:7d}  {row['label']:<20} {1e3 * row['step_s']:14.2f} {1e3 * now:9.2f}  {100 * profile.compute_s / now:13.1f}%"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
