"""Volumes (3-D stacks and scans): their files, classes, groups, resampling, the dataset and the writer."""
