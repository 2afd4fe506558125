"""`python -m train.tune`: sweep loader knobs with the real data path and train_step; report; autotune a profile."""
