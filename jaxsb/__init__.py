"""jaxsb: JAX training for long-context language models on data of wildly varying lengths.

Importing the package does not import JAX; entry points call `jaxsb.devices.setup_host_devices`
first so that, on a machine without an accelerator, 8 CPU devices are simulated.
"""

__version__ = "0.1.0"
