"""The timing model of the kernels: predicted GPU time from the CPU model (csrc/device/model/).

The CPU model runs the kernel sources thread by thread; with timing on, each thread carries
a virtual clock that the device layer's operations advance by their costs, and every wait
takes the time of what it waited for (csrc/device/model/timing.h). What comes out is a
prediction, always labelled so, calibrated on and scored against the measured GPU points
(points.json; README.md here tells the model's runs and scores).

- constants.py, h100.json: the constants for one GPU, each with its source
- points.py: the measured points (points.json), each with the commit it measured
- driver.py: emulated calls on the model, with the model's counts and timing reports
- predict.py: predicted call times at a benchmark shape from the model's runs
- fit.py: at most three constants fitted to measured times
- builds.py: an older commit's kernels built against today's device layer (calibration)
- report.py, cli.py: `python -m tools.timing predict` and `validate`
- shares.py: the warps' time by what they wait for, beside a GPU run's ncu stall samples
"""
