"""The development area: tools that measure featherweight, never imported by a training run.

- `calibrate`: measures compiled steps and fits the planner's buffer counts
  (`python -m featherweight.dev.calibrate`).
- `hlo_cost`: matmul FLOPs and operand bytes read from a compiled program's HLO, against which the
  planner's shape-based counts are tested.
- `attention_check`: every attention implementation against blockwise on the same inputs (the GPU
  check's attention rows).

The runtime packages import nothing from here (tests/test_layering.py).
"""
