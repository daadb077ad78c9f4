"""kvdrive.tools: kvstore-inspect, kvdrive-bench, kvdrive-profile, the demo and the GPU check."""

if __name__ == "tools":  # imported from the repository root by its bare folder name: see checkout.py
    from .checkout import step_aside

    step_aside(__name__)
