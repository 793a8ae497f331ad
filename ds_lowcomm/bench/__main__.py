from ds_lowcomm.bench.cli import main

if __name__ == "__main__":
    main()
