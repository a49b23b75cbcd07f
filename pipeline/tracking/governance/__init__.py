"""What a registered version must show before it serves: its model card, the promotion floor it
must reach, the review report against the champion, and the spread across seeds that both
quote (docs/guide/governance.md)."""
