import os
os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
import jax
jax.config.update("jax_num_cpu_devices", 8)
