"""Stand-in for MindSpeed (github.com/Ascend/MindSpeed, core_r0.16.0): its patch manager and
feature manager semantics, with features that replace some of the targets mindspeed-tp patches.
Each replacement raises if it ever runs, so a test that runs a model proves mindspeed-tp won."""
