"""Replay the seed write-up's scenario, picture for picture.

Run: ``python examples/seed_walkthrough.py``.

Requests A, B and C come and go in a 20-block pool, then D and E share a system prompt with
correct copy-on-write accounting. Same output as ``paged-jax demo``.
"""

from paged_jax.walkthrough import main

if __name__ == "__main__":
    raise SystemExit(main())
