"""The commands: `train` (launch/train.py), `plan`, `rehearse`; thin mains on one machine probe (probe.py) and
one argv splitter (cli/argv.py). Nothing below imports them."""
