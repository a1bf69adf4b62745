"""``python -m tiered_tbe.demo``: the main job, same as ``tiered-tbe train``."""

from tiered_tbe.train import main

if __name__ == "__main__":
    main()
