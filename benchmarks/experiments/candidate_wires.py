"""Wire prototypes the core does not ship (``ScapeConfig.wire`` refuses them), for the simulator.

- ``int2``: values in {-1, 0, 1} times the block's largest magnitude (four per byte). Measured in
  ``docs/benchmarks.md`` ("What did not work"); it lost to int4 at equal bytes.
"""

from scape_core.wire import register_integer_wire

register_integer_wire("int2", 2)
