"""Middle floor: acceptance math, the speculative decoder and the validate stage.

May import `specdistill.data`, never `specdistill.distill`.
"""
