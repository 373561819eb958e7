module github.com/google/go-containerregistry

go 1.18
