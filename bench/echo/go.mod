module slipstream/bench/echo

go 1.22
