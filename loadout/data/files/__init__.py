"""Sources read from one file or environment that holds a whole split: HDF5 (dataset=hdf5) and LMDB (dataset=lmdb)."""
