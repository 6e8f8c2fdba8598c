"""The OpenAI-compatible server: ``paged-jax serve`` (``cli``), its app (``app``), the engine
loop behind it (``async_engine``), its metrics (``metrics``) and live block page (``blocks``).

Needs the ``server`` extra: ``pip install 'paged-jax[server]'``.
"""
