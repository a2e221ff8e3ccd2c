"""The training objectives: one object per stage that the trainer calls."""
