"""Pipeline parallelism: the micro-batch orders each pipeline rank runs (GPipe, 1F1B,
interleaved 1F1B, zero bubble), checked for deadlock and simulated for their bubble."""

from coconetc.pipeline.orders import (
    ORDERS,
    Action,
    Costs,
    Order,
    Slot,
    Timeline,
    chart,
    check,
    layer_bounds,
    make,
    predicted_bubble,
    render,
    simulate,
)

__all__ = ["ORDERS", "Action", "Costs", "Order", "Slot", "Timeline", "chart", "check",
           "layer_bounds", "make", "predicted_bubble", "render", "simulate"]
