from ckptfs.ops.cli import main

main()
