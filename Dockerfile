# loadout training image.
#   docker build -t loadout .                                      # official PyTorch CUDA runtime base
#   docker build --build-arg BASE_IMAGE=loadout-base:torch2.14.1 .  # any base with python/pip + torch on PATH
# The base's torch must match constraints.txt (torch 2.14.1 wheels are CUDA 13.0 builds).
ARG BASE_IMAGE=pytorch/pytorch:2.14.1-cuda13.0-cudnn9-runtime
FROM ${BASE_IMAGE}
