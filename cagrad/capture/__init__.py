"""The trace: AutogradCompilerInstance turns a collected backward into one FX
GraphModule on FakeTensors; the opaque calls a graph makes (hooks, nodes run
as they are, AccumulateGrad); graphs cut into segments at those calls."""
