"""Pipeline parallelism: the micro-batch orders each pipeline rank runs (GPipe, 1F1B,
interleaved 1F1B, zero bubble: ZB-H1, ZB-H2, ZB-V), checked for deadlock and simulated for their bubble."""

from coconetc.pipeline.orders import (
    ORDERS,
    Action,
    Costs,
    Order,
    Slot,
    Timeline,
    chart,
    check,
    default_chunks,
    layer_bounds,
    make,
    predicted_bubble,
    render,
    simulate,
)

__all__ = ["ORDERS", "Action", "Costs", "Order", "Slot", "Timeline", "chart", "check",
           "default_chunks", "layer_bounds", "make", "predicted_bubble", "render", "simulate"]
