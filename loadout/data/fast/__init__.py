"""Fast paths: JPEG decode at the size training needs, decode on the device, the shared sample cache, the packed
format."""
