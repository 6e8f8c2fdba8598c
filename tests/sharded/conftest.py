"""The sharded tests need 8 (virtual CPU) devices, made by XLA_FLAGS before jax starts:
``tests/test_sharding.py`` runs them in a subprocess that sets it. Without them the
collection fails here (never a skip), so a subprocess that lost the flag cannot pass."""

import jax

DEVICES = 8
if jax.device_count() < DEVICES:
    raise RuntimeError(
        f"tests/sharded needs {DEVICES} devices (XLA_FLAGS="
        f"--xla_force_host_platform_device_count={DEVICES}); jax sees {jax.device_count()}. "
        "Run it through tests/test_sharding.py.")
