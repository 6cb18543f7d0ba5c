"""Pydra workflows for dpneuro (installed as ``dpneuro.workflows``)."""

from dpneuro.deploy.workflow import build_workflow, run_workflow

__all__ = ["build_workflow", "run_workflow"]
