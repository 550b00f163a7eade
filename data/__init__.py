"""Bottom floor: prompt sources, the toy world, model pairs and the Seq-KD generate stage.

Imports neither `specdistill.decode` nor `specdistill.distill`.
"""
