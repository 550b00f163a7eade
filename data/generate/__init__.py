"""The generate stage (Seq-KD): the target's outputs over a prompt set, sharded and resumable."""
