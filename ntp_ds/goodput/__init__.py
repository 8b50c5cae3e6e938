"""Goodput accounting (pure), the W&B logger and the W&B dashboard definition."""

from ntp_ds.goodput.accounting import (
                                      BUCKETS,
                                      LOST_BUCKETS,
                                      GoodputMeter,
                                      StepTiming,
                                      active_fraction,
                                      goodput,
                                      split_failure_time,
)

__all__ = ["BUCKETS", "LOST_BUCKETS", "GoodputMeter", "StepTiming", "active_fraction", "goodput",
           "split_failure_time"]
