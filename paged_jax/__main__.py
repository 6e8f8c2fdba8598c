"""``python -m paged_jax`` is the ``paged-jax`` command."""

from paged_jax.cli import main

raise SystemExit(main())
